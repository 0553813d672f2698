"""gpu-training-stack: GPU training infrastructure on AWS, Alibaba Cloud and Tencent Cloud.

`pulumi up --stack dev` runs this; `make plan` runs the same program in Pulumi's mock engine.
"""

from infra.stack.program import main

main()
