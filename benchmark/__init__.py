"""Benchmark tools: they drive the scripts in cleanrl_ddp/ as commands and read what they log."""
