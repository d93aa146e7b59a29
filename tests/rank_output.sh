#!/usr/bin/env bash
# One rank of a multi-rank pytest tier: `rank_output.sh DIR PYTEST-COMMAND...`. Rank 0 writes to
# the terminal, every other rank to DIR/rank<R>.log (tests/run.sh shows those when the tier
# fails); each rank leaves its JUnit XML in DIR/rank<R>.xml for the final table.
dir=$1
shift
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-0}}}
mkdir -p "$dir"
if [ "$rank" = 0 ]; then
    exec "$@" --junitxml="$dir/rank0.xml"
fi
exec "$@" --junitxml="$dir/rank$rank.xml" >"$dir/rank$rank.log" 2>&1
