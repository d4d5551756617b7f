"""Development tooling: the role processes (``processes``) and the local cluster that starts
them (``localcluster``, ``manage.py kvsp_cluster``). Nothing in the roles imports it."""
