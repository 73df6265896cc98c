# boinc-dl on AWS: the server, a GPU spot fleet and a CPU spot fleet, in the default VPC.

data "aws_vpc" "default" {
  default = true
}

data "aws_subnets" "default" {
  filter {
    name   = "vpc-id"
    values = [data.aws_vpc.default.id]
  }
  filter {
    name   = "default-for-az"
    values = ["true"]
  }
}

# Ubuntu 24.04 LTS (Canonical) for the server and the CPU hosts.
data "aws_ami" "ubuntu" {
  most_recent = true
  owners      = ["099720109477"]
  filter {
    name   = "name"
    values = ["ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-*"]
  }
}

# GPU hosts: Amazon's Deep Learning Base AMI (Ubuntu 22.04) ships the NVIDIA driver.
data "aws_ami" "gpu" {
  most_recent = true
  owners      = ["amazon"]
  filter {
    name   = "name"
    values = ["Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"]
  }
}

module "server" {
  source          = "../../aws/server"
  name            = var.name
  region          = var.region
  vpc_id          = data.aws_vpc.default.id
  subnet_id       = sort(data.aws_subnets.default.ids)[0]
  ami_id          = data.aws_ami.ubuntu.id
  source_repo     = var.source_repo
  source_ref      = var.source_ref
  admin_ssh_cidrs = var.admin_ssh_cidrs
}

module "gpu_fleet" {
  source               = "../../aws/spot-fleet"
  name                 = "${var.name}-gpu-spot"
  region               = var.region
  variant              = "gpu"
  instance_types       = var.gpu_instance_types
  ami_id               = data.aws_ami.gpu.id
  vpc_id               = data.aws_vpc.default.id
  subnet_ids           = data.aws_subnets.default.ids
  project_url          = module.server.project_url
  weak_key_secret_arn  = module.server.weak_key_secret_arn
  kms_key_arn          = module.server.kms_key_arn
  boinc_dl_requirement = "boinc-dl[gpu]==${var.boinc_dl_version}"
  max_size             = var.gpu_max_hosts
}

module "cpu_fleet" {
  source               = "../../aws/spot-fleet"
  name                 = "${var.name}-cpu-spot"
  region               = var.region
  variant              = "cpu"
  instance_types       = var.cpu_instance_types
  ami_id               = data.aws_ami.ubuntu.id
  vpc_id               = data.aws_vpc.default.id
  subnet_ids           = data.aws_subnets.default.ids
  project_url          = module.server.project_url
  weak_key_secret_arn  = module.server.weak_key_secret_arn
  kms_key_arn          = module.server.kms_key_arn
  boinc_dl_requirement = "boinc-dl[cpu]==${var.boinc_dl_version}"
  root_volume_gb       = 40
  max_size             = var.cpu_max_hosts
}

# The fleet controller runs on the server (it reads BOINC's database and Redis there).
resource "aws_iam_role_policy_attachment" "controller_gpu" {
  role       = module.server.role_name
  policy_arn = module.gpu_fleet.controller_policy_arn
}

resource "aws_iam_role_policy_attachment" "controller_cpu" {
  role       = module.server.role_name
  policy_arn = module.cpu_fleet.controller_policy_arn
}
