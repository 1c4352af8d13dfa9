"""The service's ``/docs`` page: its OpenAPI description as one self-contained HTML page.

FastAPI's Swagger and ReDoc pages load their scripts from a CDN, so on a robot network
without internet they are blank. This page needs nothing but the service itself: the
endpoints, their parameters, bodies and answers, and a ``curl`` line for each.
"""

from __future__ import annotations

import html
import json

__all__ = ["api_docs_html"]

_STYLE = """
body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
h2{border-bottom:1px solid #ccc;padding-bottom:.2rem}
.m{display:inline-block;min-width:4rem;font-weight:bold;color:#fff;padding:.1rem .4rem;border-radius:.2rem}
.get{background:#2a7}.post{background:#27c}
pre,code{background:#f4f4f4;border-radius:.2rem}pre{padding:.5rem;overflow:auto}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:.2rem .5rem;text-align:left;vertical-align:top}
"""


def _schema_text(schema: dict, components: dict) -> str:
    ref = schema.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[-1]
        props = components.get(name, {}).get("properties", {})
        fields = ", ".join(f"{k}: {v.get('description', v.get('type', ''))}" for k, v in props.items())
        return f"{name} {{{fields}}}" if fields else name
    return json.dumps(schema)


def api_docs_html(spec: dict) -> str:
    """One HTML page from an OpenAPI ``spec`` (``app.openapi()``)."""
    e = html.escape
    info = spec.get("info", {})
    components = spec.get("components", {}).get("schemas", {})
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(info.get('title', 'API'))}</title>",
           f"<style>{_STYLE}</style></head><body>",
           f"<h1>{e(info.get('title', 'API'))} <small>v{e(str(info.get('version', '')))}</small></h1>",
           f"<p>{e(info.get('description', ''))}</p>",
           "<p>With a token set, every endpoint but <code>/healthz</code> and this page needs "
           "<code>Authorization: Bearer TOKEN</code>. The machine-readable description is "
           "<a href='openapi.json'><code>/openapi.json</code></a>.</p>"]
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            out.append(f"<h2><span class='m {e(method)}'>{e(method.upper())}</span> <code>{e(path)}</code></h2>")
            if op.get("summary"):
                out.append(f"<p>{e(op['summary'])}</p>")
            params = op.get("parameters", [])
            if params:
                out.append("<table><tr><th>parameter</th><th>in</th><th>description</th></tr>")
                for prm in params:
                    out.append(f"<tr><td><code>{e(prm.get('name', ''))}</code></td><td>{e(prm.get('in', ''))}</td>"
                               f"<td>{e(prm.get('description', ''))}</td></tr>")
                out.append("</table>")
            body = op.get("requestBody", {}).get("content", {})
            if body:
                out.append(f"<p>Body: raw bytes, <code>Content-Type</code> one of {e(', '.join(body))}.</p>")
            out.append("<table><tr><th>status</th><th>answer</th></tr>")
            for status, resp in op.get("responses", {}).items():
                schema = next(iter(resp.get("content", {}).values()), {}).get("schema", {})
                detail = resp.get("description", "")
                if schema:
                    detail += f" — {_schema_text(schema, components)}"
                out.append(f"<tr><td>{e(str(status))}</td><td>{e(detail)}</td></tr>")
            out.append("</table>")
            if method == "post" and body:
                ctype = next(iter(body))
                out.append(f"<pre>curl -s -X POST -H 'Content-Type: {e(ctype)}' -H 'Authorization: Bearer TOKEN' "
                           f"--data-binary @frame.png http://HOST:PORT{e(path)}</pre>")
            else:
                out.append(f"<pre>curl -s -H 'Authorization: Bearer TOKEN' http://HOST:PORT{e(path)}</pre>")
    out.append("</body></html>")
    return "\n".join(out)
