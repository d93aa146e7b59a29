"""Model definitions written against mpirt's public API, and their presets."""
