"""A reward model run for real (``workload.reward_model`` on a real target): the judge's own process
(``judge_process.py``) and the service that places its instances where the stack says and asks each
verdict (``service.py``). The simulated one is ``sim/reward.py``; both record the same events."""
