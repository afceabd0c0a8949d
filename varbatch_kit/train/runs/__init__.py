"""A run from the caller's side down to the worker: plan, launch, supervise, the worker loop,
its state, checkpoints, step logs, results and export. (Named ``runs``: a ``run``
package would shadow the function ``varbatch_kit.train.run``.)
"""
