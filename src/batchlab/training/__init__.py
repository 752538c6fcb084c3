"""Training one model: the loop and everything it decides once.

    train       fit(): set-up -> loop -> result; early stopping, best epoch
    optim       the optimizer and the lr schedule: per step, or per example seen (adaptive)
    adaptive    train.adaptive_batch: the batch doubles as the measured noise scale rises
    epochs      what every epoch does and reports: the seeding rule, statistics, the non-finite guard
    strategy    device, DDP/FSDP, precision, micro-batching, decided once (Strategy)
    support     what this machine can run, from the config alone, before any process starts
    sharded     FSDP2: fully_shard, the norm from shards, DCP checkpoints
    checkpoint  atomic per-epoch checkpoints, exact resume
    resume      a resumed training continues its MLflow run
    gns         the gradient noise scale B_simple over a run: its readings, settled once an epoch
    gns_estimates  what one probe reads: |G|², tr(Σ), the standard error; readings pooled
    gns_probes  its probe: the train split's mean gradient at fixed weights; the saved weights' reading
    throughput  every batch size's step timed side by side: the study's clock, the adaptive rule's t(B)
    gns_exact   the exact value, from every row's own gradient
    memory      the tensor peak of one training step
    peaks       the process's peak memory (CUDA allocations or RSS)
    launch      torchrun; which threads each stage's process applies
    threads     the thread policy: cores a process may use, torch threads, the spawn pool
    loopback    torchrun with every socket on 127.0.0.1 on one machine

Nothing here imports the sweep, the seeds trained together or the study.
"""
