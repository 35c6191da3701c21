"""The admin HTTP API: routes, bearer token, HTTPS, metrics, the traffic check and the dashboard."""
