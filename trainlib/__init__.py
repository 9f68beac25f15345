"""trainlib: what a training script imports to run well under Phalanx.

    import trainlib
    ctx = trainlib.init()                  # before torch.distributed.init_process_group
    trainlib.run(main)                     # optional: main() again for the next generation, in this process
    loaded = trainlib.load_latest()        # .step and .state of the newest complete checkpoint, or None
    for step in range(loaded.step + 1 if loaded else 0, steps):
        ...forward, backward...
        trainlib.compute_done()            # optional: just before the gradient synchronisation
        ...all-reduce, optimizer step...
        trainlib.step(step)                # the per-step hook: ~0.5 us, no system call
        trainlib.snapshot(state, step)     # in host memory, replicated to a peer: a restart loses <= 1 step;
        if trainlib.checkpoint_requested():  # before an eviction, the agreed step's snapshot answers instead
            trainlib.save(state, step)     # durable, atomic; tells Phalanx which step is safe
    trainlib.finish()                      # optional: training is over (said by itself at destroy_process_group
                                           # and at exit): the job is no longer judged hung while it ends

Outside Phalanx (no PHALANX_JOB in the environment) every hook is a no-op, with one warning, and
`save`/`load_latest` use ./checkpoints, so the same script still runs alone. Under torchrun with
`--rdzv-backend=phalanx` the hooks report to the controller's rendezvous instead, which asks the
workers to checkpoint one agreed step before it restarts their round without an unfit node.
"""

from __future__ import annotations

from trainlib._runtime import (
    Context,
    GenerationEnded,
    checkpoint_requested,
    compute_done,
    finish,
    init,
    load_latest,
    on_checkpoint_request,
    run,
    save,
    snapshot,
    step,
)

__all__ = ["Context", "GenerationEnded", "checkpoint_requested", "compute_done", "finish", "init", "load_latest",
           "on_checkpoint_request", "run", "save", "snapshot", "step"]
