"""The batch-size sweep, from one experiment up to the whole study (imports point down this list).

probes      what an experiment measures besides training: step memory
plan        every experiment and its identity (config, key, folder, tags)
tasks       the kinds of task the sweep runs (experiments, branches, clock, truth); the Lane
truth       the exact noise scale at the target, from the weights experiments keep: a task
scoring     an experiment's result row: test scores, speed, memory, val curve, batch schedule
speeds      the throughput table every figure in seconds reads: the first task
branches    sweep.local_cbs: the seeds' branches, a task beside the experiments
experiment  one experiment run: found finished, or trained, measured, scored and recorded
state       a sweep's resume state (state.json)
lock        one sweep at a time per folder; each experiment claimed while a task trains it
groups      whether seeds train together, decided once; a batch size's seeds as one task; lanes;
            every task's dispatch (train_work) and where its result is kept
preflight   a Dask sweep's checks before anything starts: store, Prefect, scheduler, TLS
stop        an interrupted or failed Dask sweep stops its tasks running on the workers
cluster     the sweep's tasks as Prefect tasks on a Dask cluster
executors   local or Dask, decided once per sweep
run         the whole sweep: plan, run its tasks through the executor, resume, report (reads only)
"""
