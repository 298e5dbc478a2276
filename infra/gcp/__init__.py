"""Google Cloud plumbing shared by the GCP backends: credentials and clients, GCS trees,
and the launcher that runs on TPU workers."""
