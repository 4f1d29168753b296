"""Who a process is and who may call it: mutual TLS identity and per-RPC policy (`identity`),
the local certificate authority (`pki`), and files only their owner may read (`private_files`).
"""
