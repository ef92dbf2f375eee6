"""Multi-process (torchrun) tests: context parallelism with THD + GQA."""
