# terraform test, offline: the AWS provider is mocked (no credentials, no API calls;
# an apply only stores the mock's values).

mock_provider "aws" {
  mock_data "aws_caller_identity" {
    defaults = {
      account_id = "123456789012"
    }
  }
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}"
    }
  }
  mock_resource "aws_kms_key" {
    defaults = {
      arn = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
    }
  }
  mock_resource "aws_secretsmanager_secret" {
    defaults = {
      arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:bdl-redis-password-AbCdEf"
    }
  }
  mock_resource "aws_iam_role" {
    defaults = {
      arn = "arn:aws:iam::123456789012:role/bdl-server"
    }
  }
  mock_resource "aws_iam_instance_profile" {
    defaults = {
      arn = "arn:aws:iam::123456789012:instance-profile/bdl-server"
    }
  }
  mock_resource "aws_eip" {
    defaults = {
      public_ip = "203.0.113.7"
    }
  }
  mock_data "aws_subnet" {
    defaults = {
      availability_zone = "us-east-1a"
    }
  }
  mock_data "aws_secretsmanager_random_password" {
    defaults = {
      random_password = "not-a-real-password-only-a-mock-value-00"
    }
  }
}

variables {
  region      = "us-east-1"
  vpc_id      = "vpc-0123"
  subnet_id   = "subnet-0a"
  ami_id      = "ami-0123456789abcdef0"
  source_repo = "https://git.example.org/ml/boinc-dl.git"
}

# apply against the mock: user-data depends on values known only after apply.
run "defaults" {
  command = apply

  assert {
    condition     = length(aws_vpc_security_group_ingress_rule.ssh) == 0
    error_message = "no SSH unless admin_ssh_cidrs is set"
  }
  assert {
    condition     = toset([for r in aws_vpc_security_group_ingress_rule.http : r.from_port]) == toset([80]) && toset([for r in aws_vpc_security_group_ingress_rule.https : r.from_port]) == toset([443])
    error_message = "HTTP and HTTPS only"
  }
  assert {
    condition     = aws_instance.this.metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 required"
  }
  assert {
    condition     = aws_instance.this.root_block_device[0].encrypted && aws_ebs_volume.data.encrypted
    error_message = "disks encrypted"
  }
  assert {
    condition     = !strcontains(aws_instance.this.user_data, "not-a-real-password")
    error_message = "the Redis password must not be in user-data"
  }
  assert {
    condition     = strcontains(aws_instance.this.user_data, "BDL_SOURCE_REPO=https://git.example.org/ml/boinc-dl.git")
    error_message = "user-data is the rendered server cloud-config"
  }
  assert {
    condition     = output.project_url == "http://203.0.113.7/boincdl/"
    error_message = "the project's master URL is on the Elastic IP"
  }
}

run "admin_ssh" {
  command = plan

  variables {
    admin_ssh_cidrs = ["198.51.100.0/24"]
  }

  assert {
    condition     = length(aws_vpc_security_group_ingress_rule.ssh) == 1
    error_message = "one SSH rule per admin CIDR"
  }
}
