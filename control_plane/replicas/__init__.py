"""The GPU services the control plane drives: the gRPC client of one (`client`, a `Model`)
and the router that places requests over several replicas (`router`)."""
