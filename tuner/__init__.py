"""tileops' tuner: Optuna searches over each operator's configuration space, recorded per target.

`tileops-tune` (or `tileops tune`) runs a sweep, `tileops db ...` inspects and ships databases.
Modules: `cli` (the commands; `dbcli` for `tileops db`), `sweep` (a sweep over problems, one or
several workers), `search` (the trial loop of one problem), `studies` (Optuna storage, samplers,
trial bookkeeping), `session` (one worker's child processes), `evaluate` (what runs inside them),
`timing` (timers), `child` (child processes with time limits), `winners` (re-timing and the
record), `suites` (workload suites), `progress` (what the user sees), `dbtools` (database
maintenance).
"""
