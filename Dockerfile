# One image for both processes; compose.yaml picks the command. Installed as the README
# installs it: a virtual environment and an editable install of the project.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY gpu_service gpu_service
COPY control_plane control_plane
COPY kernels kernels
COPY training training
RUN python3 -m venv .venv && .venv/bin/pip install --no-cache-dir -e .
ENV PATH=/app/.venv/bin:$PATH
EXPOSE 50050 50051 8000
CMD ["met", "gpu-service", "serve", "--host", "0.0.0.0", "--port", "50051"]
