# The two commands of the README (`test` runs the linters first), plus regenerating the protos.
.PHONY: run test lint protos venv bench

PORT ?= 50051

venv:
	./scripts/setup-venv.sh

run: venv
	.venv/bin/shardserve up --ranks 2 --port $(PORT) --demo

lint: venv
	.venv/bin/ruff check .
	.venv/bin/lint-imports

test: lint
	.venv/bin/python -m pytest -q

protos: venv
	.venv/bin/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/shardserve.proto

bench: venv
	.venv/bin/python -m benchmarks
