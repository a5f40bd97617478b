"""Demo content: a few short fictional passages and questions for `kvblend demo`."""
