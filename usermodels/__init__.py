"""Your own networks for `model.factory: "usermodels.<file>:<function>"` (docs/own-model.md).

Every stage that builds the model depends on this folder in dvc.yaml: editing a file here reruns
train and what follows it.
"""
