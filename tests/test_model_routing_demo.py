"""The demo launcher starts the runtimes of a modelled service with the mesh's model and aliases
as their served names, so a call routed by any of them is accepted (no process is started)."""

from __future__ import annotations

import argparse

from meshlm.commands import serve
from meshlm.demo.launcher import LocalMesh, demo_mesh
from xds_server.mesh import parse_mesh


def served(mesh: LocalMesh) -> list[str]:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    cmd, *args = mesh.serve_args(mesh.runtimes["v1"])
    assert cmd == "serve"
    return p.parse_args(args).served_model_name


def test_a_modelled_service_serves_its_model_and_aliases(tmp_path) -> None:
    doc = demo_mesh()
    doc["services"]["llm"].update(model="smollm2-chat", aliases=["chat", "org/smollm2:q4"])
    mesh = LocalMesh(doc, workdir=tmp_path)
    assert parse_mesh(mesh.mesh).services["llm"].model == "smollm2-chat"  # what it writes
    assert served(mesh) == ["smollm2-chat", "chat", "org/smollm2:q4"]


def test_a_service_without_a_model_serves_its_name(tmp_path) -> None:
    assert served(LocalMesh(workdir=tmp_path)) == ["llm"]
