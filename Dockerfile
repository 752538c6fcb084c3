# CPU image by default; .git stays out of the image, so DVC runs without Git (core.no_scm).
# For CUDA: docker build --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    VENV=/opt/venv

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git make python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 batchlab

WORKDIR /app
COPY --chown=batchlab:batchlab . /app
RUN mkdir -p /opt/venv && chown batchlab:batchlab /opt/venv
USER batchlab

# the same pinned set-up CI uses; a CUDA torch build is installed first when TORCH_INDEX is given
RUN if [ -n "$TORCH_INDEX" ]; then \
        python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0; \
    fi \
    && make setup VENV=/opt/venv \
    && /opt/venv/bin/dvc config --local core.no_scm true

ENV PATH=/opt/venv/bin:$PATH
CMD ["make", "run", "VENV=/opt/venv"]
