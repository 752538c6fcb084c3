"""Whether a result is what it says it is.

verify     every output's bytes against the hashes DVC and MLflow recorded
reproduce  retrain a tracked run from its commit and params, and compare
"""
