"""The replica's engines: the interface the pipeline uses (`base`), its transports (`inproc`,
`inproc_speech`, `http_client`, `grpc_client`), the engine environment and our launcher."""
