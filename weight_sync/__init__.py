"""Weight sync: how trainer weights reach the engines (process groups, transports, dtype names SGLang speaks).

Never imports glue; speaks SGLang's weight endpoints itself. Submodules import torch, so import them explicitly:
`weight_sync.process_group.create_process_group`, `weight_sync.broadcast.send_tensors` / `receive_tensors`.
"""
