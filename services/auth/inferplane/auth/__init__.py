"""inferplane.auth: ApiKeyService and Envoy's ext_authz Check."""
