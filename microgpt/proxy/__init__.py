"""The training proxy (`microgpt run`): a supervisor around the engine, which it runs as a child process.

    supervisor.py   the run: phases in order, restarts from the newest valid checkpoint, signals, `microgpt run`
    child.py        the engine child process: its JSON lines on a queue, its stderr passed through, signals
    runfiles.py     <run>.loss.json, .samples.json, .state.json and their archive
    phases.py       the experiment's "phases" and "proxy" sections -> the run schedule
    sampler.py      text samples from new checkpoints (`microgpt sample` subprocesses)
    dashboard.py    the read-only HTTP server for live-loss-dashboard.html and uPlot (package data) and the runs
    dashdata.py     what the server answers from run files: new rows only, min/max per pixel, run folders

The proxy never imports the trainer: the engine's JSON lines on stdout, POSIX signals and the run's files
(checkpoints, sidecars) are the whole interface, so either side can be replaced or restarted alone.
"""
