"""Serving `POST /v1/images/generations` and `POST /v1/images/edits`.

Each of the `n` images is one run of the pipeline (seed + index when a seed is given, so image 0
of a seeded request equals the same request with n = 1). Edits exist only for pipelines whose entry
stage takes image input.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni_runtime.metrics import Router as M
from omni_runtime.router.errors import BadRequest
from omni_runtime.router.media import b64, images_of
from omni_runtime.router.orchestrator import PipelineRequest, StageEvent
from omni_runtime.router.plan import (
    Plan,
    context_drawn,
    edit_entry,
    plan_edit,
    plan_request,
    without_unweighted_companions,
)
from omni_runtime.router.protocol.images import (
    BAGEL_GUIDANCE,
    IMAGE_REFUSED,
    ImageData,
    ImageGenerationRequest,
    ImagesResponse,
    parse_size,
)
from omni_runtime.router.serving.base import ServingBase
from omni_runtime.router.serving.inputs import entry_inputs, stage_params
from omni_runtime.spec import Modality

__all__ = ["ServingImages"]


class ServingImages(ServingBase):
    endpoint = "/v1/images/generations"

    def _check_images(self, think: bool = False) -> Plan:
        if "image" not in self.producible():
            raise BadRequest(
                f"model `{self.ctx.model_name}` (pipeline {self.topology.name}) produces "
                f"{self.producible()}, not images; use /v1/chat/completions with it",
                param="model",
            )
        if not think:
            return plan_request(self.topology, ["image"])
        thinker = context_drawn(self.topology).get("image")
        if thinker is None:
            raise BadRequest(
                f"think: pipeline {self.topology.name} draws its images from no thinker's context, so it has no "
                "think mode; leave think unset",
                param="think",
            )
        return plan_request(self.topology, [self.topology.stage(thinker).output_modality.value, "image"])

    def accepts_images(self) -> bool:
        plan = plan_edit(self.topology) if "image" in self.producible() else None
        entries = plan.entry if plan else ()
        return any(Modality.IMAGE in self.topology.stage(n).input_modalities for n in entries)

    async def generate(self, body: ImageGenerationRequest, raw: Request, *, image: bytes | None = None) -> Response:
        self.check_model(body.model, required=False)
        self.check_fields(body, IMAGE_REFUSED)
        self.check_n(body.n)
        self.check_stage_params(body.sampling_params_list)
        plan = self._check_images(body.think)
        if image is not None:
            if body.think:
                raise BadRequest("think is not served for edits; leave it unset", param="think")
            plan = plan_edit(self.topology)
            self._check_edit_size(plan, body)
        if body.response_format not in (None, "b64_json"):
            raise BadRequest(
                f"response_format {body.response_format!r} is not supported; use 'b64_json' "
                "(this server keeps no image files to link to)",
                param="response_format",
            )
        try:
            size = parse_size(body.size)
        except ValueError as err:
            raise BadRequest(str(err), param="size") from None
        request_id = self.new_id("img")
        extra = {"image": image} if image is not None else None
        entry = entry_inputs(self.topology, plan, prompt=body.prompt, negative_prompt=body.negative_prompt, extra=extra)
        image_params = {
            "width": size[0] if size else None,
            "height": size[1] if size else None,
            "seed": body.seed,
            "num_inference_steps": body.num_inference_steps,
            "guidance_scale": body.guidance_scale,
            **{key: getattr(body, key) for key in BAGEL_GUIDANCE},
        }
        ar = {"seed": body.seed}
        requests = []
        for i in range(body.n):
            params = stage_params(
                self.topology, plan, ar=ar, image=image_params, per_stage=body.sampling_params_list, choice=i
            )
            self.check_image_sizes(plan, params)
            requests.append(
                PipelineRequest(
                    request_id=request_id,
                    plan=without_unweighted_companions(self.topology, plan, params),
                    entry=entry,
                    params=params,
                    negative_prompt=body.negative_prompt,
                    choice=i,
                )
            )
        images: dict[int, list[bytes]] = {}
        thoughts: dict[int, list[str]] = {}
        image_stages = {n for n, sp in plan.stages.items() if sp.final and sp.modality is Modality.IMAGE}
        started = time.monotonic()
        first = True

        def collect(event: StageEvent) -> None:
            nonlocal first
            if event.stage not in image_stages:  # think mode's thinker: its reasoning, in pieces
                if isinstance(event.data, dict) and isinstance(event.data.get("text"), str):
                    thoughts.setdefault(event.choice, []).append(event.data["text"])
                return
            found = images_of(event.data)
            if found and first:
                first = False
                M.ttfp.labels(self.pipeline.name, "image").observe(time.monotonic() - started)
            images.setdefault(event.choice, []).extend(found)

        results = await self.run_to_end(raw, requests, collect)
        data = []
        final = next(n for n in plan.final if n in image_stages)
        for i, result in enumerate(results):
            info = result.info.get(final, {})
            revised = info.get("prompt") if isinstance(info.get("prompt"), str) else None
            if body.think:
                revised = "".join(thoughts.get(i, []))
            extra = {}
            if isinstance(info.get("negative_prompt"), str):
                extra["revised_negative_prompt"] = info["negative_prompt"]
            for png in images.get(i, []):
                data.append(ImageData(b64_json=b64(png), revised_prompt=revised, **extra))
        if not data:
            raise BadRequest("the pipeline finished without an image; check the prompt and parameters")
        return JSONResponse(ImagesResponse(data=data).model_dump(exclude_none=True))

    def _check_edit_size(self, plan: Plan, body: ImageGenerationRequest) -> None:
        """400 for a size asked of an edit whose stage builds the context from the picture (`plan_edit`): BAGEL
        draws an edit at its picture's size, so a size would be ignored."""
        if plan.entry != (edit_entry(self.topology),):
            return
        order = self.topology.topological_order()
        index = order.index(plan.entry[0])
        per_stage = (body.sampling_params_list or [])[index : index + 1]
        asked = body.size not in (None, "auto") or any(
            (p or {}).get(k) is not None for p in per_stage for k in ("height", "width")
        )
        if asked:
            raise BadRequest(
                f"size: stage {plan.entry[0]!r} draws an edit at its input picture's size (resized as the model "
                "resizes it); leave size unset",
                param="size",
            )

    async def edit(self, raw: Request) -> Response:
        """Multipart form: `image` (file), `prompt`, optional `n`, `size`, `seed`, `negative_prompt`..."""
        if not self.accepts_images():
            raise BadRequest(
                f"model `{self.ctx.model_name}` (pipeline {self.topology.name}) takes no image input, so it "
                "cannot edit images; use /v1/images/generations, or serve a pipeline whose first stage "
                "accepts images",
                param="image",
            )
        form = await raw.form()
        upload = form.get("image") or form.get("image[]")
        if upload is None or not hasattr(upload, "read"):
            raise BadRequest("the form has no 'image' file; send the image to edit as multipart 'image'",
                             param="image")  # fmt: skip
        if "mask" in form:
            raise BadRequest(f"mask is not supported: {IMAGE_REFUSED['mask'][0]}", param="mask")
        fields: dict[str, str | int] = {k: v for k, v in form.items() if isinstance(v, str)}
        for key in ("n", "seed", "num_inference_steps"):
            if key in fields:
                try:
                    fields[key] = int(fields[key])
                except ValueError:
                    raise BadRequest(f"{key} must be an integer, got {fields[key]!r}", param=key) from None
        body = ImageGenerationRequest.model_validate(fields)
        return await self.generate(body, raw, image=await upload.read())
