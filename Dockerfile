# One image for both processes; compose.yaml picks the command. Installed as the README
# installs it: a virtual environment and an editable install of the project, with
# TORCH_INDEX_URL as an extra index: PyTorch's CUDA wheels by default (compose.yaml), its CPU
# wheels for compose.cpu.yaml. The project's torch pin matches the index's build (`+cu128`,
# `+cpu`), which pip ranks above the plain version on PyPI.
# gcc: Triton compiles its CUDA driver stub with a C compiler when it first runs.
FROM python:3.11-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
COPY pyproject.toml README.md ./
COPY protos protos
COPY gpu_service gpu_service
COPY control_plane control_plane
COPY kernels kernels
COPY training training
COPY tools tools
COPY met met
RUN python3 -m venv .venv && .venv/bin/pip install --no-cache-dir \
        --extra-index-url "$TORCH_INDEX_URL" -e .
ENV PATH=/app/.venv/bin:$PATH
EXPOSE 50050 50051 8000
CMD ["met", "gpu-service", "serve", "--host", "0.0.0.0", "--port", "50051"]
