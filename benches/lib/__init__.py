"""What the benchmark scripts share, one concern per module (nothing here imports torch at module level, so a
script's ``--help`` is fast):

- :mod:`benches.lib.env`: where a script measures (:class:`~benches.lib.env.Env`), its time budget
  (:class:`~benches.lib.env.Deadline`), logging and memory helpers;
- :mod:`benches.lib.cli`: the options every script shares and the skeleton of a script's ``main``;
- :mod:`benches.lib.towers`: the tower table (one :class:`~benches.lib.towers.TowerSpec` row per tower: config
  and model classes, real and tiny geometry, where its geometry facts live in the config, how it takes inputs);
- :mod:`benches.lib.cases`: visuals, fixed cases, the sizes a tower sees, and the tensors of one call;
- :mod:`benches.lib.trace`: the seeded traffic trace;
- :mod:`benches.lib.systems`: the systems compared and :class:`~benches.lib.systems.TowerBench`, one tower
  ready to run through each;
- :mod:`benches.lib.compiled`: the torch.compile systems, dynamo's counters, hard time caps;
- :mod:`benches.lib.startup`: cold and warm capture of ``encgraph.graphed(tower)`` (compile cache directories,
  the second process);
- :mod:`benches.lib.timing`: latency measurement and the matmul floor;
- :mod:`benches.lib.outputs`: comparing outputs;
- :mod:`benches.lib.results`: result files (JSON and markdown) and table formatting.
"""
