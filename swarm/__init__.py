"""The library that every role shares, in layers (each imports only the ones before it):

- this package's own modules: settings (config), logging (log), processes (procs), file layout (layout),
  waits (waiting), and the compression and fault specs (compression, faults);
- ``swarm.patches``: what this project changes in hivemind, one module per hivemind area;
- ``swarm.training``: the model, the data, checkpoints, system figures, the logbook;
- ``swarm.net``: networking and trust (the node, invites, the fence, records in the DHT);
- ``swarm.averaging``: the Lightning strategy around hivemind.Optimizer, DiLoCo, the round screen.

tests/test_layers.py checks the order; ``python -m tests.import_graph`` draws it.
"""

from swarm.log import fork_safe_logging

fork_safe_logging()  # hivemind forks its averagers while this process's threads log
