"""State that outlives a request: stored responses (read from the audit log), background responses and batches (jobs
any proxy of a fleet may run, under leases), files, and conversations. Its tables sit beside the log in the audit
database (tables.py); every answer it gives is an ordinary record of the log."""
