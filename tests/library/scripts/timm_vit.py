"""A tiny timm ViT trained with timm's attention written op by op (TIMM_FUSED_ATTN=0, as set by a user who
once exported the model, or an old environment): softmax chain inside timm's Attention.forward."""

import os

os.environ["TIMM_FUSED_ATTN"] = "0"

import timm  # noqa: E402
import torch  # noqa: E402

torch.manual_seed(0)
model = timm.create_model(  # expect: model
    "vit_tiny_patch16_224",
    pretrained=False,
    img_size=32,
    patch_size=8,
    embed_dim=32,
    depth=2,
    num_heads=2,
    num_classes=10,
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 3, 32, 32)
y = torch.randint(0, 10, (4,))
for step in range(6):
    loss = torch.nn.functional.cross_entropy(model(x), y)  # expect: call
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.6f}")
print(f"fused_attn {model.blocks[0].attn.fused_attn}")  # which attention timm ran
