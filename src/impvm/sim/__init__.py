"""impvm.sim: replay a workflow-job trace through the real pool deciders (``impvm simulate``).

- :mod:`impvm.sim.trace`: job traces (CSV or JSON of queued time, labels, duration), their
  parser (one-line errors naming the row and field) and a generator of bursty days.
- :mod:`impvm.sim.model`: the world the deciders do not control: VM time-to-ready and GitHub's
  assignment delay, as seeded distributions.
- :mod:`impvm.sim.policies`: scaling policies: this project's decider with a fixed or adaptive
  warm pool (:func:`impvm.scaling.decide` and :func:`impvm.scaling.warm_pool_target`), and the
  formulas ARC, GARM and Imp use, each citing its source.
- :mod:`impvm.sim.engine`: the discrete-event loop; :mod:`impvm.sim.report`: the table, JSON
  and plot.

Nothing here touches Kubernetes, GitHub or the network.
"""
