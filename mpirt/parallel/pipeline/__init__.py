"""Pipeline parallelism: the stage (stage), the executor of any schedule (executor), the schedules
as data (schedules), their checker (check) and the layer partition (partition)."""
