"""`kvedit eval`: accuracy vs KV compression per policy on a real model, in the live engine.

tasks (generators) · filler (haystack text) · tokenizer (ids + chat template) · runner
(accuracy cells) · gain (decode throughput per cell) · stats (Wilson) · report (JSON,
table, charts) · run (orchestration) · cli (`kvedit eval` flags).
"""
