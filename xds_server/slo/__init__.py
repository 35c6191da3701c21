"""The SLO loop: objectives measured, actions taken (shed, tighten, scale), the request-class
quarantine and the access-log service that feeds it."""
