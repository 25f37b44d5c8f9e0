"""The service's process: its flags (`options.py`), the gRPC server and the servicer that
unpacks each message, calls the engine and packs the reply; protobuf stops here.

The top floor of the service: may import every other `gpu_service` package."""
