# One image for both processes; the compose file picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY gpu_service gpu_service
COPY control_plane control_plane
COPY kernels kernels
RUN pip install --no-cache-dir -e . && met init-model
EXPOSE 50051
CMD ["met", "gpu-service", "serve", "--host", "0.0.0.0", "--port", "50051"]
