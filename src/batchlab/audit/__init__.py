"""Whether a result is what it says it is.

verify     every output's bytes against the hashes DVC and MLflow recorded
reproduce  retrain a tracked run from its commit and params, and compare
noise      the exact gradient noise scale of a trained model, beside training's estimate
"""
