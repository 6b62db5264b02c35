"""The main job: a small model through torch.compile(backend="gac") — no gac_torch import needed.

The target follows the inputs: CUDA tensors compile for the GPU (PTX), CPU tensors for the CPU
reference target. Prints the coverage report and the error against eager.
"""

import torch


class SmallNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.conv(x)).softmax(-1)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = SmallNet().eval().to(device)
    x = torch.randn(4, 3, 32, 32, device=device)
    compiled = torch.compile(model, backend="gac")
    with torch.no_grad():
        got, want = compiled(x), model(x)
    from gac_torch.frontends.dynamo import compiled_graphs  # only to show the report

    print(f"target: {compiled_graphs[-1].target}")
    print(f"coverage: {compiled_graphs[-1].report}")
    print(f"max |gac - eager| = {(got - want).abs().max().item():.3e}")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    print("OK: torch.compile(backend='gac') matches eager")


if __name__ == "__main__":
    main()
