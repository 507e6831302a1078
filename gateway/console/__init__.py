"""The operator's web console at `/console/` on the HTTP API's port (docs/console.md):
server-rendered pages over a narrow port of the running gateway (`port.ConsolePort`)."""
