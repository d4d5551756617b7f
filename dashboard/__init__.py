"""The operator dashboard of the control plane: the cluster at a glance, one page per instance,
session and holder, live refresh, and the operator's actions (drain, sleep, wake an instance;
withdraw replicas; abort a reshard) through the same service functions as the API.

``sections`` says what each page shows, ``views`` serves the pages, their live JSON and the
actions, ``leases`` reads the leases nodes record. Templates are under ``templates/dashboard/``,
scripts and styles under ``static/dashboard/``.
"""
