"""The seeds of one batch size trained together, as one stacked model: each seed's weights and
history equal a separate run's (the MLP's bit for bit on CPU, any other module's within 1e-5), at
a fraction of the cost.

    vectorized  fit_seeds(): the stacked training loop; whether a sweep trains its seeds together
    group       what both stacked forms share: a seed's slice of the weights and gradients, its norm
    stacked     the stacked MLP's forward and hand-written backward
    functional  any other module's: vmap over functional_call, autograd's backward; which cannot
    standins    dropout and attention layers that take each seed's masks as inputs under vmap
    optimizer   the seeds' optimizers over the stacked parameters
    branches    the seeds' local-CBS branches (sweep.local_cbs) from one point, together
"""
