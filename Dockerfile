# One image for the control plane (`cpn serve`) and the site agents (`cpn agent`).
#
#   docker compose up --build          # PostgreSQL, control plane, three sites (docker-compose.yml)
#
# torch is pinned like everywhere in cpn. Installed from the default index it is the CUDA
# build (right for agents on GPU hosts, gigabytes in size); for a CPU-only demo image pass
# PyTorch's CPU wheel index (pytorch.org's install selector shows it):
#   docker compose build --build-arg PIP_TORCH_ARGS="--index-url <cpu wheel index>"
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
COPY agents ./agents
COPY proto ./proto
COPY migrations ./migrations
RUN pip install . && useradd --system --create-home cpn
USER cpn
WORKDIR /home/cpn

# gRPC agent service, HTTP API.
EXPOSE 50051 8080
ENTRYPOINT ["cpn"]
CMD ["--help"]
