"""Multi-node operation (gateway, scheduler, shared state). Not built yet: a single node
serves everything. It must not change sandbox state except through node APIs.
"""
