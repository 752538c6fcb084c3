"""The seeds of one batch size trained together, as one stacked model: each seed's weights and
history equal a separate run's (bit for bit on CPU), at a fraction of the cost.

    vectorized  fit_seeds(): the stacked training loop; whether a sweep trains its seeds together
    stacked     the stacked MLP's forward and hand-written backward
    optimizer   the seeds' optimizers over the stacked parameters
"""
