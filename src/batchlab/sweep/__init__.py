"""The batch-size sweep, from one experiment up to the whole study (imports point down this list).

truth       the exact noise scale at the target, from the weights experiments keep
scoring     an experiment's result row: test scores, speed, memory, val curve, batch schedule
probes      what an experiment measures besides training: step memory
speeds      the throughput table every figure in seconds reads, measured as the first step
plan        every experiment and its identity (config, key, folder, tags); Lane, Work
experiment  one experiment run: found finished, or trained, measured, scored and recorded
state       a sweep's resume state (state.json)
lock        one sweep at a time per folder; each experiment claimed while a task trains it
groups      whether seeds train together, decided once; a batch size's seeds as one task; lanes
preflight   a Dask sweep's checks before anything starts: store, Prefect, scheduler, TLS
stop        an interrupted or failed Dask sweep stops its tasks running on the workers
cluster     the experiments as Prefect tasks on a Dask cluster
executors   local or Dask, decided once per sweep
run         the whole sweep: plan, resume, parent run, report
"""
