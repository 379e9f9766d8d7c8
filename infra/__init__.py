"""AWS infrastructure of moerl as CDK stacks (network, storage, cluster, promotion pipeline).

`infra.config` holds the typed deployment config shared with charts8s/; `infra.app` is the CDK
app that cdk.json runs.
"""
