# One image for the control plane (`cpn serve`) and the site agents (`cpn agent`).
#
#   docker compose up --build          # PostgreSQL, control plane, three sites (docker-compose.yml)
#
# Not built here (no Docker engine on the machine it was written on); tests/integration/
# test_compose.py checks that what it copies exists and what it runs is in the CLI.
#
# torch is pinned like everywhere in cpn. Installed from the default index it is the CUDA
# build (right for agents on GPU hosts, gigabytes in size); docker-compose.yml, whose sites
# have virtual GPUs, passes PyTorch's CPU wheel index in PIP_TORCH_ARGS:
#   docker build --build-arg PIP_TORCH_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu" .

# The dashboard's chart library from the npm registry, as scripts/setup.sh vendors it.
FROM node:20-slim AS ui
ARG UPLOT=1.6.32
WORKDIR /ui
RUN npm pack --silent "uplot@${UPLOT}" && tar -xzf "uplot-${UPLOT}.tgz" \
    && mkdir vendor && cp package/dist/uPlot.iife.min.js package/dist/uPlot.min.css vendor/ \
    && cp package/LICENSE vendor/uPlot.LICENSE && echo "${UPLOT}" > vendor/VERSION

FROM python:3.11-slim

ARG PIP_TORCH_ARGS=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/cpn
RUN pip install ${PIP_TORCH_ARGS} "torch==2.13.0"

COPY pyproject.toml README.md ./
COPY cpn ./cpn
COPY api ./api
COPY --from=ui /ui/vendor ./api/ui/vendor
COPY agents ./agents
COPY proto ./proto
COPY migrations ./migrations
# The demo profile waits with it for the sites to register (docker-compose.yml).
COPY scripts/wait_for_sites.py ./scripts/wait_for_sites.py
# The agents' work directory (a volume in docker-compose.yml) belongs to the user they run as.
# With the agents' optional packages: NVML for GPU discovery, the Kubernetes client for
# `cpn agent --backend kubernetes`.
RUN pip install ".[nvml,kubernetes]" && useradd --system --create-home cpn \
    && mkdir -p /var/lib/cpn && chown cpn /var/lib/cpn
USER cpn
WORKDIR /home/cpn

# gRPC agent service, HTTP API and dashboard.
EXPOSE 50051 8080
ENTRYPOINT ["cpn"]
CMD ["--help"]
