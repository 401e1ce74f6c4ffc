"""The seed's path of the training proxy: `python -m microgpt.training_proxy EXP.json` is `microgpt run EXP.json`.

The code lives in the package microgpt/proxy/ (supervisor, engine child, run files, phases, sampler, dashboard).
"""

from microgpt.proxy.supervisor import main

if __name__ == "__main__":
    raise SystemExit(main())
