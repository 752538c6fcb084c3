"""The study's analysis of a sweep's result rows: no training, no sweep, no I/O but the report.

analysis  lr per batch size, steps to target, the table rows, the headline figures
critical  the critical batch size (the S/E hyperbola fit) and its interval
verdict   which batch size, and why: paired t-tests by seed, Holm-corrected over every pair
adaptive  sweep.adaptive's row against every fixed batch size, paired by seed, Holm-corrected
report    summary.md, summary.csv, curves.csv
clock     the report's section on the throughput table it read its seconds from
plots     the study's PNGs
memory_fit  the largest batch within sweep.memory_budget_mb, from the measured step memory
"""
