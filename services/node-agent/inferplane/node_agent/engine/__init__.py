"""Engine replicas: the interface (`api`), the launcher, the supervisor and transports."""
